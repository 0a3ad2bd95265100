"""Training runtime for GEM-ref: one concept per module, imported explicitly (nothing is re-exported
here, so importing gemcompile does not pull in torch.distributed.checkpoint or rich).

- train.py       TrainConfig, train(), TrainResult; `gemcompile train` flags (add_train_arguments,
                 run_train_from_args)
- metrics.py     normalized entropy and exact AUC per task; MetricWindow over the last steps
- checkpoint.py  DCP save / resume (bit-exact), single process or distributed, compiled models too
- flops.py       padded FLOPs (FlopCounterMode), useful FLOPs (section-8 formula), peak table, mfu()
- validate.py    validate_batch(): input checks at the model boundary, outside the compiled graph
"""
