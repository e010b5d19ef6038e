"""A document source over a Python list, for the data tests."""

from __future__ import annotations

from dtrain.data.sources import DocumentSource


class ListSource(DocumentSource):
    """Documents from a Python list; position = list index."""

    description = "test documents"

    def __init__(self, docs):
        self.docs = docs

    def documents(self, start=0):
        yield from ((i, d) for i, d in enumerate(self.docs) if i >= start)
