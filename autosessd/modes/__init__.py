"""The engine's modes that span one Sessions: a router in front of several models (models.py,
a Sessions per loaded model), an engine that sleeps when idle and frees every slot
(sleep.py), and the start after a reboot that puts each slot's last conversation back
(comeback.py). None knows another. May import: sessions and what is below it."""
