"""The planner: the analytic estimate of a layout's per-device memory and step time, phase by phase
(``estimate``: ``state``, ``layer``, ``head``, ``pipeline``, ``roofline``), its fitted constants with
where they were measured (``constants``), its one cache (``cache``) and the search over every layout
of N devices (``search``); ``meshtrain.plan`` is its command line."""
