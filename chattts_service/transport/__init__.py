"""How requests reach the application: the gunicorn server and its intake worker."""
