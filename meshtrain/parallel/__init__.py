"""Parallelism, one file per concern, applied in this order:

1. ``rules.py``   - the logical-axis rules table: data parallel (batch over ``data`` and ``fsdp``),
                    FSDP (parameters' ``embed`` over ``fsdp``), tensor parallel (``vocab`` and the
                    model family's TENSOR-role axes over ``tensor``), sequence parallel (the
                    residual stream's ``sequence`` over ``tensor``), context parallel (positions over
                    ``fsdp``, the batch over ``data``). Presets compose these.
2. ``pipeline.py`` - pipeline parallelism over ``stage`` (GPipe, 1F1B, interleaved, ZB-H1): adds
                    the rule ``layers -> stage`` for parameters and runs each (accumulation)
                    microbatch through its schedule's table (``schedules.py``) with the executor
                    (``executor.py``: a ``shard_map`` manual over ``stage`` only), the layers'
                    auxiliary losses included; ``layer_order.py`` fixes the layers' storage order.
3. ``layout.py``  - ``Layout``: the rules completed for the family, every feasibility check and
                    the at-rest specs; the one object the trainer and the planner share.
4. ``zero.py``    - the ZeRO stage: which of optimizer state, gradients and parameters keep the
                    ``fsdp`` split.
5. ``offload.py`` - the optimizer state in pinned host memory between steps.
6. ``sharding.py`` - specs to ``NamedSharding``s for parameters, optimizer state and batches;
   ``activations.py`` - the model's door to the mesh: activation constraints, the attention
                    scheme the rules imply (``ring_attention.py`` where the keys stay split along
                    the sequence; the trainer permutes each batch into its balanced order first),
                    and the expert exchange of a sorted mixture-of-experts dispatch (``experts.py``:
                    token choices to the devices holding their experts and back, by all-to-all).
7. ``accumulate.py`` - gradient accumulation: microbatches scanned inside the jitted step, the
                    accumulator kept in the gradients' sharding.

Remat is a property of the model's scanned layer stack (``models.common.RematPolicy``); precision
(``meshtrain/precision.py``) casts the fp32 master weights to the compute dtype inside the step.
"""
