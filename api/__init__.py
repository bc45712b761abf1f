"""REST API: thin FastAPI routers over the service layer."""
