"""The meshtrain model zoo: models that name logical axes only."""
