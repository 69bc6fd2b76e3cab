"""The process's life: Ctrl-C and SIGTERM stop a run at once and leave it resumable
(``interrupts``), and a watchdog stops what Ray leaves behind a killed driver (``reaper``)."""
