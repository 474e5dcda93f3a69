"""tskv's version: one place, read by the package, the build and a publisher's descriptor."""

VERSION = "0.1.0"
