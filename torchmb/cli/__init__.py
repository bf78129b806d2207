"""What ``python -m torchmb`` runs, apart from the library's core: ``demo`` (:mod:`torchmb.cli.demo`: a
learning-rate x weight-decay sweep of small CNNs on the digits data, whose data and model the tutorials use
too) and ``bench`` (:mod:`torchmb.cli.bench`: torchmb against ``torch.func.vmap``, a loop and one plain
model; its workloads are in :mod:`torchmb.cli.bench_steps`, their models in :mod:`torchmb.cli.bench_models`
and :mod:`torchmb.cli.bench_zoo`, a row's measurement in :mod:`torchmb.cli.bench_measure`, its memory
estimate in :mod:`torchmb.cli.bench_memory`, the ratios and tables in :mod:`torchmb.cli.bench_report`) and
``kernels`` (:mod:`torchmb.cli.kernels`: which kernel a batched convolution of a given shape takes, from
``batch_layers``' kernel table).

Adding a bench workload: a module of its own here that builds the model and calls
``bench_steps.register_workload(Workload(name, ...))``, imported by :mod:`torchmb.cli.bench` beside
``bench_zoo``.
"""
