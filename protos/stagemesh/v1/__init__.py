"""Code generated from protos/stagemesh/v1/*.proto by protos/generate.py; do not edit."""
