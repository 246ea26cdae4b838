"""What a running system shows an operator: a worker's Prometheus metrics (``metrics.py``)
and the queue gauges read from Redis by ``sandboxq exporter`` (``exporter.py``), and the
filter that keeps an outage to one log line per cause per 10 s (``quiet.py``).
"""
