"""Shared test fixtures that are not tests: the S3 fault proxy, a loopback TCP pair, the observability checks
(Prometheus parser, headless Chromium) and forged SparseLoCo fragments."""
