"""The runtime of GEM-ref, in three floors; nothing is imported or re-exported here (importing a module of
one floor never pulls in the other, and importing gemcompile pulls in neither).

    training/      the training loop and what it needs; may import anything in gemcompile but cli
      train.py         train(): the loop, step by step
      config.py        TrainConfig (validated), gem_config()
      flags.py         `gemcompile train`: its flags (the --parallel sizes too) and how they run
      report.py        TrainResult, WindowSummary, TrainReporter (progress bar, log lines, summary)
      optimizers.py    Adam on dense weights, Adagrad on embedding tables (sparse: tables/)
      parallel.py      `train --parallel`: torchrun, the plan applied, compile per FSDP unit
      checkpoint.py    DCP save / resume (bit-exact), single process or distributed, compiled models too
      metrics.py       normalized entropy and exact AUC per task; MetricWindow over the last steps
      validate.py      validate_batch(): input checks at the model boundary, outside the compiled graph
      flops.py         padded FLOPs (FlopCounterMode), useful FLOPs (section-8 formula), peak table, mfu()
      kernel_time.py   the GPU's own time of a step and where it goes (torch.profiler)
      e2e_bench.py     `gemcompile bench e2e`: the training step under eager, inductor and gem_compile
    tables/        tables trained on their looked-up rows, used by both floors above; imports only lowering/
      sparse_tables.py SparseGrad modules: lookups file row gradients instead of a dense .grad
      sparse_adagrad.py SparseAdagrad: torch's Adagrad state, updates only the filed rows
    distributed/   the 5D parallel plan and its application under torch.distributed
      plan.py          the plan as pure functions (no torch.distributed calls): imports only config;
                       the sharding pass (passes/sharding.py) and explain read it
      apply.py         ParallelRuntime: meshes, sharded tables, expert parallelism, FSDP, the step's pieces
      embedding.py     2D-sharded embedding tables, looked up by all-to-all
      experts.py       expert parallelism for GEM's dense expert ensembles
      collectives.py   differentiable collectives, CollectiveCounter
    apply.py, embedding.py, experts.py and collectives.py import only distributed/, lowering/, models/
    and config: never the compiler (backend, passes, explain) nor training/.
"""
