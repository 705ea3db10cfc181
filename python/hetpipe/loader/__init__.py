"""Where minibatches come from: the data-source contract, per-VW sharding and the start-up data check."""

from hetpipe.loader.source import DatasetSource, DataSource, PerVWSource, StreamSource, as_source

__all__ = ["DataSource", "DatasetSource", "StreamSource", "PerVWSource", "as_source"]
