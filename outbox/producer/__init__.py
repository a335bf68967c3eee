"""The producer: `ResilientProducer` and the parts it is built from.

`resilient` assembles them from its arguments, checked once by `settings`. A message goes in
through `admission` (send, probe, hold behind its key, or store), is sent first by `firstsend`
over `link` (the one librdkafka producer), and, when it cannot be, goes into the outbox through
`spill` and the group-commit `writer`, in per-key order (`keyorder`: the key backlog, the hold-back and the send fence).
`writeahead` is the mode that stores first. `storedcallbacks` and `pollreport` carry what happened back to the
application.
"""
