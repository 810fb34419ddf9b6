"""The DVBench service: ingestion API, database, validation workers, pages."""
