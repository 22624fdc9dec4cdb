"""`ft soak`: a live `ft serve` under a bounded mix of concurrent requests, with faults, for a while
(docs/SOAK.md). harness.py drives the server and its clients, probes.py samples the server's processes and
shared memory, report.py turns the run into checks, a JSON report and a PNG plot."""
