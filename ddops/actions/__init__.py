"""Stand-alone scripts that change a host (stdlib only, run with the host's python3 like the probes):
install or restore a unit, stop the training job, take or give back the pivot lock.

Kept apart from `ddops.probes`, which only read: what is in here is what a dry run never sends.
"""
