"""The worker of a stage kind that exists only in tests/test_new_stage.py: a spec plus this file is the whole stage."""

from verlflow.core.stages.common import stage_main


def run(ctx) -> dict:
    if ctx.is_main():
        (ctx.out / "hello.txt").write_text(f"hello from seed {ctx.bp.seed}")
    return {"greetings": 1}


main = stage_main(run)

if __name__ == "__main__":
    main()
