"""The sample text `inferno calibrate` runs when given none: about five hundred tokens of prose, code, a chat turn
and numbers (kept apart from benchmarks/quality.py's evaluation texts)."""

CALIBRATION_TEXTS = [
    "The river rises in the hills north of the town, where a dozen small streams meet in a marshy valley. For most "
    "of the year it is shallow enough to wade across, but after the spring rains it swells quickly, and the old "
    "stone bridge has been rebuilt three times since the eighteenth century. Farmers along its banks grow barley, "
    "potatoes and apples, and in autumn the orchards send their fruit to a cooperative press near the station.",
    "import json\nfrom pathlib import Path\n\n\ndef load_settings(path: str) -> dict:\n"
    "    \"\"\"Read a JSON settings file, falling back to defaults for missing keys.\"\"\"\n"
    "    defaults = {\"timeout\": 30, \"retries\": 3, \"verbose\": False}\n"
    "    file = Path(path)\n    if not file.exists():\n        return defaults\n"
    "    with file.open() as f:\n        values = json.load(f)\n    return {**defaults, **values}\n\n\n"
    "class Counter:\n    def __init__(self):\n        self.counts = {}\n\n    def add(self, word):\n"
    "        self.counts[word] = self.counts.get(word, 0) + 1\n",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nCan you explain what a "
    "hash table is?<|im_end|>\n<|im_start|>assistant\nA hash table stores key-value pairs in an array. A hash "
    "function turns each key into an index, so looking a key up takes about the same time however many entries "
    "there are. When two keys land on the same index, the table resolves the collision, for example by keeping a "
    "short list at each slot or by probing the next free one.<|im_end|>\n",
    "Quarterly report: revenue grew 12.4% to $3.82 million, while operating costs rose 7.1% to $2.95 million. "
    "The gross margin was 41.3%, up from 38.9% a year earlier. Headcount increased from 57 to 64, and the company "
    "opened offices in Lisbon and Montreal. Table 2 lists sales by region: Europe 1,204; North America 1,567; "
    "Asia 731; other 318 (thousands of units).",
    "Le soleil se couchait derrière les collines lorsque nous sommes arrivés au village. Die Straßen waren leer, "
    "nur ein Hund bellte in der Ferne. 夜になると、空には無数の星が輝いていた。 Al día siguiente, partimos temprano "
    "hacia la costa, donde el viento soplaba con fuerza sobre las olas.",
]
