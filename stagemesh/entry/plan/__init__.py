"""`stagemesh plan`: choose tensor / pipeline / data parallel sizes and show their memory math."""
