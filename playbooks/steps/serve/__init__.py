"""Serving: rendered units, who runs them (systemd or a process), deploy with its load-log check,
the RPC workers, the load balancer, and the units beside the servers."""
