"""Planning: from a model and hardware to a plan.

Specs and pricing (``specs``, a transformer's layers: ``transformer``), cutting layers
into stages (``balance``), fitting a schedule into memory (``plan_memory``), the cluster
search (``cluster``, ``cluster_costs``): these import no torch, so ``zeropipe plan`` runs
without it.
Profiling real stages (``profiling``) and profile-to-plan (``plan``: ``auto_plan``,
``profile``) need torch and the runtime, the layer below.
"""
