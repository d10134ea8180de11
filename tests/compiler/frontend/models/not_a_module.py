def model():
    return {"not": "a module"}
