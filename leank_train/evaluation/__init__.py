"""Evaluation of a mask: long-context probes, the methods that answer them, the loop, statistics and reports.

Read in this order (each module imports only those before it): ``tasks`` (the RULER-style probes) and
``needles`` (the older needle kinds); ``stats`` (Wilson intervals, paired counts, the headline);
``prefill`` (one dense prefill per batch of probes, shared by every method, and decoding from it);
``methods`` (full, learned LeanK, random and ThinK channels: one small class each); ``kl``; ``loop``
(``evaluate``, ``ratio_sweep``); ``settings`` and ``report`` (tables, model-card rows). The ``leank eval``
command line is :mod:`leank_train.evaluate`.
"""
