# The fixtures and hooks of every test, tests/ and bench/tests/ alike (a seed per test, GPU tests
# skipped without a GPU): kvcached.testing.pytest_plugin.
pytest_plugins = ["kvcached.testing.pytest_plugin"]
