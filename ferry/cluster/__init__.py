"""`ferry up`'s parts: the cluster file's schema (``config``), the processes it turns into
(``plan``), and the supervisor that runs, watches, restarts and stops them (``child``,
``supervisor``). Nothing here imports torch: `ferry up` only starts other `ferry` processes.
"""
