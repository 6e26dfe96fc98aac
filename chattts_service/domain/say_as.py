"""SSML's ``<say-as>``: a text read the way its ``interpret-as`` says, not as normalisation
would guess ("1234" is "one thousand two hundred thirty four" as a cardinal, "one two three
four" as digits, "twelve thirty four" as the normaliser reads a bare number in English).

Numbers, digits, characters and telephone numbers are written out in words here, in English or
Chinese; dates are first written in the one form the normaliser cannot misread (``2024-03-05``
or ``March 5``), and they and times are then written out by the
normaliser in that language. What comes out is words: the normalisers that read the text later
leave it as it is.
"""

from __future__ import annotations

import re
from collections.abc import Callable

KINDS = ("characters", "cardinal", "ordinal", "digits", "date", "time", "telephone")
DATE_FORMATS = ("ymd", "mdy", "dmy", "ym", "my", "md", "dm", "y")
MAX_DIGITS = 15  # the longest integer read as a number (below a thousand trillion)

EN_DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
ZH_DIGITS = "零一二三四五六七八九"
EN_TEENS = [
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
]
EN_TENS = ["_", "_", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
EN_SCALES = ((10**12, "trillion"), (10**9, "billion"), (10**6, "million"), (1000, "thousand"))
EN_ORDINALS = {
    "one": "first",
    "two": "second",
    "three": "third",
    "five": "fifth",
    "eight": "eighth",
    "nine": "ninth",
    "twelve": "twelfth",
}
MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
_NUMBER = re.compile(r"([+-]?)(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?")
_TIME = re.compile(r"(\d{1,2})[:：](\d{2})(?:[:：](\d{2}))?\s*([ap]\.?m\.?)?", re.IGNORECASE)


class SayAsError(ValueError):
    """The text is not what its ``interpret-as`` says it is; the message says why."""


def say_as(
    kind: str,
    text: str,
    language: str,
    date_format: str | None = None,
    normalise: Callable[[str, str], str] | None = None,
) -> str:
    """``text`` read as ``kind`` in ``language`` (zh or en). Dates and times need
    ``normalise(text, language)``: the text normaliser."""
    text = text.strip()
    if not text:
        raise SayAsError("it is empty")
    zh = language == "zh"
    if kind == "characters":
        return _characters(text, zh)
    if kind == "digits":
        digits = re.sub(r"[\s,.\-]", "", text)
        if not digits.isdigit():
            raise SayAsError(f"digits are read one by one: {text!r} is not digits")
        return _spell(digits, zh)
    if kind == "telephone":
        return _telephone(text, zh)
    if kind in ("cardinal", "ordinal"):
        return _number(text, zh, ordinal=kind == "ordinal")
    if normalise is None:
        raise ValueError("dates and times are written out by the normaliser")
    if kind == "date":
        return normalise(_date(text, zh, date_format), language)
    if kind == "time":
        if not _TIME.fullmatch(text):
            raise SayAsError(f"a time is H:MM or H:MM:SS, with am or pm or not; not {text!r}")
        return normalise(text, language)
    raise SayAsError(f"interpret-as {kind!r} is not one of {', '.join(KINDS)}")


def _spell(digits: str, zh: bool, telephone: bool = False) -> str:
    if zh:
        words = "".join(ZH_DIGITS[int(d)] for d in digits)
        return words.replace("一", "幺") if telephone else words
    return " ".join(EN_DIGITS[int(d)] for d in digits)


def _characters(text: str, zh: bool) -> str:
    spelled = []
    for char in text:
        if char.isspace():
            continue
        if char.isdigit() and char.isascii():
            spelled.append(_spell(char, zh))
        elif char.isascii() and char.isalpha():
            spelled.append(char.upper())
        else:
            spelled.append(char)
    return " ".join(spelled)


def _telephone(text: str, zh: bool) -> str:
    if not re.fullmatch(r"\+?[\d\s().\-]+", text) or not any(c.isdigit() for c in text):
        raise SayAsError(f"a telephone number is digits, spaces, ( ) - . and a leading +: {text!r}")
    groups = re.findall(r"\d+", text)
    spoken = ("，" if zh else ", ").join(_spell(group, zh, telephone=True) for group in groups)
    if text.startswith("+"):
        spoken = ("加" if zh else "plus ") + spoken
    return spoken


def _number(text: str, zh: bool, ordinal: bool) -> str:
    match = _NUMBER.fullmatch(text.replace(" ", ""))
    if match is None:
        raise SayAsError(f"{text!r} is not a number")
    sign, whole, fraction = match.groups()
    digits = whole.replace(",", "")
    if len(digits.lstrip("0")) > MAX_DIGITS:
        raise SayAsError(f"{text!r} has more than {MAX_DIGITS} digits")
    if ordinal and (sign or fraction):
        raise SayAsError(f"an ordinal is a whole number of 1 or more, not {text!r}")
    value = int(digits)
    if ordinal and value == 0:
        raise SayAsError("an ordinal is a whole number of 1 or more, not 0")
    if zh:
        words = _zh_cardinal(value)
        if fraction:
            words += "点" + _spell(fraction, zh)
        if sign == "-":
            words = "负" + words
        return "第" + words if ordinal else words
    words = _en_cardinal(value)
    if fraction:
        words += " point " + _spell(fraction, zh)
    if sign == "-":
        words = "minus " + words
    return _en_ordinal(words) if ordinal else words


def _en_below_thousand(value: int) -> list[str]:
    words = []
    hundreds, rest = divmod(value, 100)
    if hundreds:
        words += [EN_DIGITS[hundreds], "hundred"]
    if rest >= 20:
        tens, ones = divmod(rest, 10)
        words += [EN_TENS[tens], EN_DIGITS[ones]] if ones else [EN_TENS[tens]]
    elif rest >= 10:
        words.append(EN_TEENS[rest - 10])
    elif rest or not words:
        words.append(EN_DIGITS[rest])
    return words


def _en_cardinal(value: int) -> str:
    if value == 0:
        return "zero"
    words = []
    for scale, name in EN_SCALES:
        count, value = divmod(value, scale)
        if count:
            words += [*_en_below_thousand(count), name]
    if value:
        words += _en_below_thousand(value)
    return " ".join(words)


def _en_ordinal(words: str) -> str:
    head, _, last = words.rpartition(" ")
    if last in EN_ORDINALS:
        last = EN_ORDINALS[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    else:
        last += "th"
    return f"{head} {last}" if head else last


def _zh_below_ten_thousand(value: int, leading: bool) -> str:
    """1-9999 in Chinese; ``leading``: the number's first group (10-19 read as 十..., not 一十)."""
    words, zero = "", False
    for unit_value, unit in ((1000, "千"), (100, "百"), (10, "十"), (1, "")):
        digit, value = divmod(value, unit_value)
        if digit:
            if zero:
                words += "零"
                zero = False
            if not (digit == 1 and unit == "十" and leading and not words):
                words += ZH_DIGITS[digit]
            words += unit
        elif words:
            zero = True
    return words


def _zh_cardinal(value: int) -> str:
    if value == 0:
        return "零"
    groups = []
    while value:
        value, group = divmod(value, 10_000)
        groups.append(group)
    words = ""
    for index in range(len(groups) - 1, -1, -1):
        group = groups[index]
        if group:
            if words and group < 1000:
                words += "零"
            words += _zh_below_ten_thousand(group, leading=not words)
            words += ("", "万", "亿", "万亿")[index]
        # a group of zeros adds nothing: the next group's 零 says there was a gap
    return words


def _date(text: str, zh: bool, date_format: str | None) -> str:
    """A date as the normaliser reads it without guessing, from its numbers in ``date_format``'s
    order (default: ymd for a text beginning with four digits, else mdy in English and ymd in
    Chinese)."""
    numbers = [int(n) for n in re.findall(r"\d+", text)]
    if date_format is None:
        date_format = "ymd" if re.match(r"\d{4}", text) or zh else "mdy"
    if date_format not in DATE_FORMATS:
        raise SayAsError(f"format {date_format!r} is not one of {', '.join(DATE_FORMATS)}")
    if len(numbers) != len(date_format) or re.search(r"[^\d\s/.\-年月日,]", text):
        raise SayAsError(f"{text!r} is not a date in the form {date_format}")
    parts = dict(zip(date_format, numbers, strict=True))
    year, month, day = parts.get("y"), parts.get("m"), parts.get("d")
    if month is not None and not 1 <= month <= 12:
        raise SayAsError(f"{text!r}: there is no month {month}")
    if day is not None and not 1 <= day <= 31:
        raise SayAsError(f"{text!r}: there is no day {day}")
    if year is not None and month is not None and day is not None:
        return f"{year:04d}-{month:02d}-{day:02d}"
    if zh:
        return "".join(
            f"{value}{unit}" for value, unit in ((year, "年"), (month, "月"), (day, "日")) if value
        )
    if month is None:
        return str(year)
    month_name = MONTHS[month - 1]
    return f"{month_name} {day}" if day is not None else f"{month_name} {year}"
