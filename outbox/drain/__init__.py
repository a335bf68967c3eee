"""The drain: re-sending what the outbox holds.

`workers` claims due rows and re-sends them, in threads (`Drainer`) or in a process of its own
(`process`). `sendloop` produces a batch and collects each message's fate; `settle` decides,
in one place, what happens to a message after a send.
"""
