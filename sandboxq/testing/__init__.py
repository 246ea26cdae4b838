"""Testing aids that ship with sandboxq, importable without pytest (the pytest plugin,
``sandboxq.pytest_plugin``, is built on them):

    handlers       misbehaving handlers: hang, spin, hold the GIL, crash, exit, leak memory
    cases          each handler with the settings that provoke it and the outcome it must give
    workers        every worker a test starts (threads, burst runs, `sandboxq worker`
                   processes), from one factory that always stops them
    waiting        wait_for: poll a condition against a deadline that names what it waits for
    processes      which processes a test left behind
    redis_server   a throwaway redis-server on a free port or a Unix socket
    redis_cluster  a throwaway 3-master Redis Cluster; moves a slot as resharding would
    redis_sentinel a master, a replica and sentinels; kills the master for a failover
    proxy          a TCP proxy that delays, stalls or cuts traffic (network faults)
    ledger         a handler that logs its executions, and the check that none overlapped
    contract       the suite every Backend must pass
"""
