"""Choosing a configuration from measurements: ``autotune`` (bucket size and other knobs tuned
during the first steps, :mod:`.search` its deterministic search) and ``recommend`` (the
algorithm for a measured network, ``with_bagua(..., "auto")``)."""
