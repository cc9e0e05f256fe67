"""Packaging for Amazon Managed Service for Apache Flink.

``python -m deploy.build_managed_flink_zip`` builds the application zip (see
``deploy/README.md`` for the layout and the deployment walkthrough); ``deploy.main`` is
the zip's Python main file; ``deploy.local_run`` runs an unpacked zip locally the way
Managed Flink would, for smoke tests before an upload.
"""
