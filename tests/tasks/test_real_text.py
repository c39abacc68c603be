from tasks.real_model.text import real_documents, write_heldout_text
from tasks.records import read_text_corpus


def test_calib_and_eval_documents_are_disjoint_real_prose_and_code():
    calib, evals = real_documents("calib"), real_documents("eval")
    assert not {n for n, _ in calib} & {n for n, _ in evals}
    for docs in (calib, evals):
        assert any(n.startswith("topic:") for n, _ in docs) and any(n.startswith("stdlib:") for n, _ in docs)
        assert all(len(text) >= 6000 for _, text in docs)


def test_the_heldout_file_holds_one_long_document_per_line_half_prose(tmp_path):
    path = write_heldout_text(tmp_path / "heldout.txt", documents=6)
    lines = read_text_corpus(path)
    prose = {" ".join(t.split()) for n, t in real_documents("eval") if n.startswith("topic:")}
    assert len(lines) == 6 and sum(line in prose for line in lines) == 3
    assert all(len(line) >= 5000 and "\n" not in line for line in lines)
