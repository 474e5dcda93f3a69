"""The shells: Trio tasks that own ZeroMQ sockets, move bytes between them and the core, and
carry out what the core decides (one task per socket). The public ones are re-exported from
`tskv`."""
