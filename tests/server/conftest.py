from tests.stamping import writers_stamp_their_pages  # noqa: F401 (autouse fixture of these tests)
