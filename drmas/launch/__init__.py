"""Entry points: the `drmas` CLI (cli.py: the command table; commands.py: the commands
that are not a run's processes), `drmas train`, which starts and supervises every role on
this machine (train.py, supervisor.py, progress.py, placement.py), `drmas probe`,
`drmas eval`, `drmas report` and `drmas status`, and Slurm jobs (slurm.py). Nothing
outside this package imports it."""
