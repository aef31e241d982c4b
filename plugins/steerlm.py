"""SteerLM (Dong et al. 2023) formatting: attribute-conditioned supervised rows. A row's `attributes` ({name:
integer level}) are written into its prompt as NeMo-Aligner's attribute string ("name:level,..."), so the model learns
to answer as asked; at inference the same string asks for the levels you want (evals.gsm8k --attributes)."""

from common.completions import without
from common.data import bad_field, map_rows
from common.errors import DataError


def attribute_label(attributes: object, where: str) -> str:
    """SteerLM's attribute string: integer levels as `name:value` joined by commas, no spaces (NeMo-Aligner's
    examples/nlp/data/steerlm/attribute_annotate.py writes e.g. "quality:4,toxicity:0,humor:0,creativity:0" from a
    fixed name list); here names are sorted, so rows and --attributes agree whatever order they list them in."""
    if not isinstance(attributes, dict) or not attributes:
        raise DataError(f"{where}: field 'attributes': must be a non-empty {{name: level}} object: {attributes!r:.60}")
    for name, value in attributes.items():
        if not name or set(name) & set(",: \t\n"):  # the separators would make the string ambiguous
            raise DataError(f"{where}: field 'attributes': name {name!r} is empty or holds ',', ':' or a space")
        if isinstance(value, bool) or not isinstance(value, int | float) or not float(value).is_integer():
            # SteerLM conditions on integer levels (0-4 in NeMo-Aligner, rounded from the attribute model's scores)
            raise DataError(f"{where}: field 'attributes.{name}': must be an integer level, got {value!r}")
    return ",".join(f"{k}:{int(attributes[k])}" for k in sorted(attributes))


def parse_attributes(spec: str, flag: str) -> str:
    """ "correct:1,length:0" (the value of `flag`, named in errors) -> the attribute string training wrote for the
    same values."""
    pairs = [p.partition(":") for p in spec.split(",")]
    bad = [n + s + v for n, s, v in pairs if not s or not v.strip().lstrip("-").isdigit()]
    if bad:
        raise DataError(f"{flag} {spec!r}: {bad[0]!r} is not name:integer (e.g. correct:1,length:0)")
    attributes = {n.strip(): int(v) for n, _, v in pairs}
    if len(attributes) < len(pairs):
        raise DataError(f"{flag} {spec!r}: a name is given twice")
    return attribute_label(attributes, flag)


def steer_prompt(prompt: str | list[dict], label: str, where: str) -> str | list[dict]:
    """The prompt with SteerLM's attribute string written in. NeMo-Aligner puts it in a label slot of its own template
    (<extra_id_2>) between the assistant header and the reply; chat templates have no such slot, so it goes into
    "system" (default: its own line at the end of the system turn, which is added if absent; the user's words stay
    as they are) or "user" (its own last line of every user turn, closest to the reply like SteerLM's). A plain-text
    prompt gets it as its first ("system") or last ("user") line."""
    if isinstance(prompt, str):
        return f"{label}\n{prompt}" if where == "system" else f"{prompt}\n{label}"
    if where == "user":
        return [m | {"content": f"{m['content']}\n{label}"} if m["role"] == "user" else m for m in prompt]
    if prompt and prompt[0]["role"] == "system":
        return [prompt[0] | {"content": f"{prompt[0]['content']}\n{label}"}] + prompt[1:]
    return [{"role": "system", "content": label}] + prompt


def steer_rows(rows: list[dict], where: str = "system") -> list[dict]:
    """SteerLM's attribute-conditioned rows: each validated supervised row's `attributes` ({name: integer level}) is
    written into its prompt (steer_prompt) and dropped. Rows without attributes come back untouched (the same list);
    once one row has them every row needs the same names."""
    first = next((r for r in rows if r.get("attributes") is not None), None)
    if first is None:
        return rows
    names = sorted(first["attributes"]) if isinstance(first["attributes"], dict) else []

    def steer(row: dict) -> dict:
        if row.get("attributes") is None:
            bad_field(row, "attributes", f"missing, but {first.get('_loc')} has them: every row needs the same names")
        label = attribute_label(row["attributes"], row.get("_loc", "<row>"))
        if sorted(row["attributes"]) != names:
            bad_field(
                row, "attributes", f"names {sorted(row['attributes'])} differ from {names} in {first.get('_loc')}"
            )
        field = "messages" if "messages" in row else "text" if "text" in row else "prompt"
        if field == "text":
            bad_field(row, "attributes", "a {text} row has no prompt to write them into")
        return without(row, "attributes") | {field: steer_prompt(row[field], label, where)}

    return map_rows(rows, steer, "attributes")
