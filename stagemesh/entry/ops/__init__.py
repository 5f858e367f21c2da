"""Operations on a running `stagemesh serve` mesh (mp backend): a rolling restart of every service, adding and
removing data-parallel replicas (by hand or by the autoscaler), and the authenticated admin API and commands
(`stagemesh rollout`, `stagemesh scale`) that start them. docs/operations.md is the operator's page."""
