"""Small files and helpers shared by the tests."""
