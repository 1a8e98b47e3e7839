"""Parallelism, one file per concern, applied in this order:

1. ``rules.py``   - the logical-axis rules table: data parallel (batch over ``data`` and ``fsdp``),
                    FSDP (parameters' ``embed`` over ``fsdp``), tensor parallel (``heads``,
                    ``kv_heads``, ``mlp``, ``vocab`` over ``tensor``). Presets compose these.
2. ``sharding.py`` - turns the rules into ``NamedSharding``s for parameters, optimizer state,
                    batches and activation constraints, and validates them against the model.
3. ``pipeline.py`` - pipeline parallelism over ``stage`` (GPipe, 1F1B, interleaved): adds the
                    rule ``layers -> stage`` for parameters and runs each (accumulation)
                    microbatch through a ``shard_map`` schedule manual over ``stage`` only.
4. ``accumulate.py`` - gradient accumulation: microbatches scanned inside the jitted step, the
                    accumulator kept in the parameters' sharding.

Remat is a property of the model's scanned layer stack (``models.common.RematPolicy``); precision
(``meshtrain/precision.py``) casts the fp32 master weights to the compute dtype inside the step.
"""
