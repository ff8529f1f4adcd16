"""Cluster operations: where Ray comes from and the actors' environment (``ray_cluster``),
placing the pools (``placement``) and draining a spot node before its interruption
(``preemption``)."""
