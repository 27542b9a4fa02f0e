"""Tools around a job: the launcher that restarts it (launch) and the flight-record reader (doctor)."""
