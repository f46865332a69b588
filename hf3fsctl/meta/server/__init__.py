"""The metadata service (`hf3fsctl serve`): `app.create_app(store)` and `run.run_server`.

Importing this package imports nothing heavy; `app`, `routes` and `run` import FastAPI.
"""
