"""Prefect tasks and the coarse steps they wrap: the pieces a flow composes."""
