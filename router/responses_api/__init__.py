"""The Responses API (/v1/responses): request, output, store, handlers."""
