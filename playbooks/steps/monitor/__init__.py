"""`invoke monitor`'s parts on a host: the GPU exporter program, the scrape configuration, the
units of Prometheus and its exporters, and Prometheus's reload."""
