"""CURVE: who may connect (the ZAP decision, exposed addresses), the certificate files, and the
settings a socket needs. Apart from the core because it needs zmq's key functions, and from the
shells because it moves no bytes."""
