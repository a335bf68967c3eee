"""The project's own tests opt in to the test-bed plugin (it is not registered on install)."""

pytest_plugins = ["outbox.testing.plugin"]
