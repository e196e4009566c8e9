"""The benchmarks and studies (list: benchmarks/README.md), a package so that a script in
any group imports the shared modules by their full name (`benchmarks.provenance`,
`benchmarks.studies.study_stats`, ...) after putting the repository on `sys.path`."""
