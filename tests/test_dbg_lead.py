def test_x(tmp_path):
    import sys
    from h3_core import tiny
    try:
        tiny.build(tmp_path, seed=0)
    except Exception:
        print({k: getattr(v, "__file__", None) for k, v in sys.modules.items() if "gguf" in k})
        print(sys.path[:5])
        raise
