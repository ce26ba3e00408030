"""The data plane: requests and their checks (``requests``), turning them into backend calls
(``executor``), handles, fusion buffers and bucket planning (``fusion``), process-set groups,
fixed schedules (``schedule``), pooled CUDA events and the NCCL watchdog. It never imports the
control plane."""
