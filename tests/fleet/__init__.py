"""The fleet (aperf.fleet) against a real nats-server the tests start; some need the
kernel too (marked ``kernel``)."""
