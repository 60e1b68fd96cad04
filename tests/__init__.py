"""The tests, laid out as minimoe/ is: tests/core/ tests minimoe/core/, ...; cross-cutting ones here."""
