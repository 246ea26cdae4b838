"""The sandboxed child pool: children, their supervisor, and process-tree kills.

pool.py         the public ``Pool`` (``submit``, ``execute``, ``kill``, ``shutdown``)
supervisor.py   the thread that owns every child and runs each attempt to its end, with
                commands.py (what other threads ask of it), assign.py (which task goes
                to which child), deadlines.py, deaths.py (a child is gone: how its
                attempts end) and spawn.py (starting children, the fork server)
handles.py      the parent's records: ``Attempt``, ``Child``
messages.py channel.py   what crosses a child's pipe, and the pipe
memory.py       the page of values a child shares with its parent, and with nothing else
child.py        the child's own main loop (runs in the child); descriptors.py, the first
                thing it does: keep only its channel and stdio
guard.py        the guard, a process of the pool's own that enforces fence deadlines when
                the worker cannot, and ends every child when the worker dies; its
                program is guard_process.py
kill.py server.py containment.py cgroups.py limits.py   kills, orphans, control groups
privileges.py   what a child gives up before its processor loads (read-only cgroup
                mounts, capabilities, user and group, network)
pid_namespace.py  a child in a PID namespace of its own, whose processes end with it
pool_lock.py    a pool's lifetime lock on its groups: cleanup touches only the dead
teardown.py     a deadline kill settled once nothing of the attempt can run
"""
