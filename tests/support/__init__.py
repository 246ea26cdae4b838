"""The project's own test bench: what this repository's tests use and users do not.

    contract           the suite every Backend must pass (run by tests/test_contract.py)
    proxy              a TCP proxy that delays, stalls or cuts traffic (network faults)
    redis_cluster      a throwaway 3-master Redis Cluster; moves a slot as resharding would
    redis_sentinel     a master, a replica and sentinels; kills the master for a failover
    prometheus_server  a real Prometheus scraping a worker and the exporter
    ledger             a handler that logs its executions, and the check that none overlapped
    gates              handlers a test holds at a point of its choosing (a file it creates)
    server_stats       what a redis-server says it ran: script calls, function libraries

Processors here are named ``tests.support.<module>:<function>``; tests/conftest.py puts
the repository on ``PYTHONPATH`` so every process a test starts can import them.
"""
